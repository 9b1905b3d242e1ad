# install rules: filled in
