"""Errors a user can fix: one base type, found behind Ray's wrapper and explicit chaining, and
reported by the CLI in one place (message, no traceback, exit code 2); anything else raises."""

import pytest

from rlkit.common.errors import CheckpointError, UserError, find_user_error
from rlkit.cli import main


def test_the_user_error_behind_wrappers_is_found():
    import ray.exceptions

    err = CheckpointError("/x/step_000001/trainer/model_tp00.pt: missing model shard")
    wrapped = ray.exceptions.RayTaskError("TrainWorker.load", "Traceback ...", err).as_instanceof_cause()
    assert find_user_error(wrapped) is err  # the original, not Ray's dual class with its traceback
    try:
        try:
            raise err
        except CheckpointError as inner:
            raise RuntimeError("while resuming") from inner
    except RuntimeError as outer:
        assert find_user_error(outer) is err
    assert find_user_error(ValueError("a bug")) is None
    context_only = RuntimeError("cleanup failed")
    context_only.__context__ = err  # raised while handling, not because of it: not reported
    assert find_user_error(context_only) is None


def test_every_listed_error_is_a_user_error():
    from rlkit.buffers import BufferStateError
    from rlkit.checkpoint import CheckpointError as RunCheckpointError
    from rlkit.config import RecipeError
    from rlkit.data.prompts import DataError
    from rlkit.plugins import PluginNotFound
    from rlkit.rollout.demo_models import DemoModelError
    from rlkit.rollout.engines.process import ProcessStartError
    from rlkit.rollout.engines.sglang_launcher import SGLangNotInstalled
    from rlkit.rollout.filters import FilterFailure
    from rlkit.rollout.http.router import RouterError
    from rlkit.train.hf_arch import UnsupportedModelError
    from rlkit.train.megatron.checkpoint import CheckpointError as TrainerCheckpointError

    for cls in (BufferStateError, RunCheckpointError, RecipeError, DataError, PluginNotFound,
                DemoModelError, ProcessStartError, SGLangNotInstalled, FilterFailure, RouterError,
                UnsupportedModelError, TrainerCheckpointError):
        assert issubclass(cls, UserError), cls


def test_the_cli_reports_a_user_error_without_a_traceback(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (f"rlkit: {tmp_path / 'nothing'}: neither a trainer checkpoint, a run checkpoint "
                   "with trainer/ nor a run folder with a checkpoint\n")
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe file not found" in capsys.readouterr().err


def test_the_cli_lets_a_bug_raise(monkeypatch):
    import rlkit.commands.export as export

    def bug(*a, **k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(export, "export_checkpoint", bug)
    with pytest.raises(ZeroDivisionError):
        main(["export", "a", "b"])
