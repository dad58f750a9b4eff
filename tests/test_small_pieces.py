"""doctor, the torchrun entry's loader, the alpha-beta fit, the collective picture, the GPU path."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import parlib  # noqa: E402
from parlib.collectives import draw_collective, fit_alpha_beta  # noqa: E402
from parlib.doctor import report  # noqa: E402
from parlib.magic import ranks_magic  # noqa: E402
from parlib.run import load  # noqa: E402


def test_doctor_reports_each_world_size():
    text = report()
    for n in (1, 2, 4, 8):
        assert f"N={n}: " in text
    assert "forkserver" in text or "spawn" in text


def test_run_load_resolves_and_rejects():
    assert load("os.path:join") is __import__("os").path.join
    with pytest.raises(SystemExit, match="MODULE:FUNCTION"):
        load("os.path.join")


def test_fit_alpha_beta_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    a, b = fit_alpha_beta(sizes, [2e-4 + 3e-9 * n for n in sizes])
    assert a == pytest.approx(2e-4, rel=1e-6) and b == pytest.approx(3e-9, rel=1e-6)
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0], [1.0])
    with pytest.raises(ValueError):
        fit_alpha_beta([1.0, 2.0], [0.0, 1.0])


def test_draw_collective_shapes():
    fig = draw_collective("all-gather", [[1], [2]], [[1, 2], [1, 2]], caption="2 ranks, CPU")
    assert len(fig.axes) == 2 and fig.axes[0].get_title() == "all-gather: before"
    with pytest.raises(ValueError, match="ranks"):
        draw_collective("x", [[1]], [[1], [2]])


def test_magic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="ranks"):
        ranks_magic("--nonsense", "x = 1")
    with pytest.raises(ValueError, match="ranks"):
        ranks_magic("explode")


@pytest.mark.gpu
def test_nccl_one_rank_on_gpu():
    def f():
        t = torch.ones(4, device=parlib.device())
        dist.all_reduce(t)
        return str(t.device), dist.get_backend(), t.sum().item()

    assert parlib.launch(f, world_size=1, backend="nccl") == [("cuda:0", "nccl", 4.0)]
