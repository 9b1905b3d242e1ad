"""Makes `import mooncake.engine` give kvlink.mooncake (and `mooncake.store`
kvlink.mooncake_store) where no Mooncake is installed.

Opt-in: installed only on request, with kvlink_mooncake_alias.pth, which
imports this module when Python starts (see kvlink's README, "Python"). It
appends a finder to the end of sys.meta_path, so Python's own finders, which
find an installed Mooncake, always come first: a real Mooncake is never
shadowed. Only where none is found does `mooncake` become a stand-in package
whose `engine` is kvlink.mooncake. Nothing of kvlink is imported before
`mooncake.engine` is, so Python's start-up cost is this small module.

KVLINK_MOONCAKE_ALIAS=0 turns the alias off; =force puts kvlink first even
where a Mooncake is installed, and says so on stderr.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        module.__kvlink_alias__ = True
        if module.__name__ == "mooncake":
            module.__doc__ = "Stand-in for Mooncake, given by kvlink (_kvlink_mooncake_alias)."
            return
        # The real work: imports kvlink's C++ module.
        if module.__name__ == "mooncake.store":
            from kvlink import mooncake_store as impl
        else:
            from kvlink import mooncake as impl

        for name in impl.__all__:
            setattr(module, name, getattr(impl, name))
        module.__doc__ = impl.__doc__


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, force):
        self.force = force

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "mooncake":
            if self.force and importlib.machinery.PathFinder.find_spec(fullname) is not None:
                sys.stderr.write("kvlink: KVLINK_MOONCAKE_ALIAS=force: mooncake.engine is kvlink, "
                                 "not the Mooncake installed here\n")
            return importlib.util.spec_from_loader(fullname, _Loader(), is_package=True)
        if fullname in ("mooncake.engine", "mooncake.store"):
            parent = sys.modules.get("mooncake")
            if getattr(parent, "__kvlink_alias__", False):  # never inside a real Mooncake
                return importlib.util.spec_from_loader(fullname, _Loader())
        return None


def install():
    """Adds the finder (once), as the environment says."""
    mode = os.environ.get("KVLINK_MOONCAKE_ALIAS", "").strip().lower()
    if mode in ("0", "off", "no", "false"):
        return
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    finder = _Finder(force=(mode == "force"))
    if finder.force:
        sys.meta_path.insert(0, finder)
    else:
        sys.meta_path.append(finder)


install()
