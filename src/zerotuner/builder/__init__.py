"""The config builder page: a form evaluated by the same code as `config` and `plan`."""
