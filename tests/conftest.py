"""Suite-wide hooks: the random test order's seed is printed at the end of every run (``-q`` hides
pytest-randomly's header line), so a failing order can be repeated with ``--randomly-seed=N``."""


def pytest_terminal_summary(terminalreporter, config):
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"tests ran in random order: repeat it with --randomly-seed={seed}")
