"""pytest plugin for llama.cpp's server tests run against gdsrun (see run.py): the presets'
model downloads are skipped (the shim serves $GDS_SUITE_MODEL whatever preset a test picks)."""


def pytest_sessionstart(session):
    import utils  # llama.cpp's tools/server/tests/utils.py, on sys.path through its conftest

    utils.ServerPreset.load_all = staticmethod(lambda: None)
