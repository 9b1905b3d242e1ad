"""The opt-in alias: `import mooncake.engine` gives kvlink where no Mooncake
is installed, never shadows one that is, and can be turned off or forced.
Each case runs a fresh interpreter whose site directory holds the alias
(as after `cmake --install --component mooncake_alias` or the pip install
of python/mooncake-alias)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import kvlink

SITE = Path(kvlink.__file__).resolve().parent.parent  # where the .pth is, in the build tree


def run(code: str, extra_path: str = "", **env: str) -> subprocess.CompletedProcess:
    # site.addsitedir processes the .pth as an installed site directory would.
    prog = f"import site; site.addsitedir({str(SITE)!r})\n" + textwrap.dedent(code)
    e = dict(os.environ, **env)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(SITE)) if p)
    return subprocess.run([sys.executable, "-c", prog], env=e, capture_output=True, text=True,
                          timeout=60)


def test_alias_gives_kvlink():
    r = run("""
        import mooncake.engine as m
        from mooncake.engine import TransferEngine, TransferOpcode, TransferNotify
        import mooncake
        assert mooncake.__kvlink_alias__
        e = m.TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        assert e.get_rpc_port() > 0
        print("ok", TransferOpcode.Write, m.TransferEngine.__module__)
    """)
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout and "kvlink.mooncake" in r.stdout


def test_a_real_mooncake_wins(tmp_path):
    fake = tmp_path / "mooncake"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "engine.py").write_text("class TransferEngine:\n    origin = 'mooncake'\n")
    r = run("""
        import mooncake.engine as m
        print(m.TransferEngine.origin)
    """, extra_path=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "mooncake" and r.stderr == ""
    forced = run("""
        import mooncake.engine as m
        print(m.TransferEngine.__module__)
    """, extra_path=str(tmp_path), KVLINK_MOONCAKE_ALIAS="force")
    assert forced.returncode == 0, forced.stderr
    assert forced.stdout.strip() == "kvlink.mooncake"
    assert "KVLINK_MOONCAKE_ALIAS=force" in forced.stderr


def test_alias_off():
    r = run("import mooncake.engine", KVLINK_MOONCAKE_ALIAS="0")
    assert r.returncode != 0 and "No module named 'mooncake'" in r.stderr


def test_startup_does_not_import_kvlink():
    r = run("""
        import sys
        assert "_kvlink_mooncake_alias" in sys.modules
        assert "kvlink" not in sys.modules and "kvlink._kvlink" not in sys.modules
    """)
    assert r.returncode == 0, r.stderr


def test_which_one():
    r = run("import runpy; runpy.run_module('kvlink.mooncake', run_name='__main__')")
    assert "mooncake.engine -> kvlink" in r.stdout, r.stdout + r.stderr


def test_an_alias_on_pythonpath_is_inert_and_the_diagnostic_says_so(tmp_path):
    # As `cmake --install build --component python --prefix P` and
    # `--component mooncake_alias --prefix P` leave it, reached by PYTHONPATH
    # only: Python does not process .pth files there (issue 28).
    import shutil
    prefix = tmp_path / "lib" / "python3" / "site-packages"
    shutil.copytree(SITE / "kvlink", prefix / "kvlink",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("_kvlink_mooncake_alias.py", "kvlink_mooncake_alias.pth"):
        shutil.copy(SITE / f, prefix / f)
    env = dict(os.environ, PYTHONPATH=str(prefix))

    def py(*args):
        return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                              timeout=60)

    plain = py("-c", "import mooncake.engine")
    assert plain.returncode != 0 and "No module named 'mooncake'" in plain.stderr
    said = py("-m", "kvlink.mooncake")
    assert said.returncode == 1
    assert f"installed in {prefix}" in said.stdout, said.stdout
    assert "not a site directory" in said.stdout and "site.addsitedir" in said.stdout
    assert "is not installed" not in said.stdout
    # What it advises works.
    fixed = py("-c", f"import site; site.addsitedir({str(prefix)!r}); import mooncake.engine as m; "
                     "print(m.TransferEngine.__module__)")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "kvlink.mooncake"


def test_alias_gives_kvlink_store():
    r = run("""
        import mooncake.store as m
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        s = MooncakeDistributedStore()
        assert s.put("k", b"v") == -600  # not set up: refused, not crashed
        print("ok", m.MooncakeDistributedStore.__module__, ReplicateConfig().replica_num)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "kvlink.mooncake_store", "1"]
