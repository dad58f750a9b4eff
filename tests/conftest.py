import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def clean_checks(monkeypatch):
    """No check mode or log from the environment, and an empty score table, around a test."""
    from parlib.course.check import check

    monkeypatch.delenv("PARLIB_CHECK_MODE", raising=False)
    monkeypatch.delenv("PARLIB_CHECK_LOG", raising=False)
    check.reset()
    yield
    check.reset()
