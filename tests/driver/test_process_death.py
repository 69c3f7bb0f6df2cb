"""Which process of a run died, from the error the driver got (Cluster.died), on a real Ray: the
actor a failed call names, or, for an error from Ray that names none of the run's actors (a
trainer rank fetching groups whose owner died), the one the run's actors say is dead."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from rlkit.common.errors import ProcessDied, actor_death

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_session():
    ray = pytest.importorskip("ray")
    from rlkit.driver.local_ray import LocalRay

    own = LocalRay()  # as a run starts it: token auth, nothing left in ~/.ray
    own.start(2)
    yield ray
    own.stop()


class RolloutActor:  # named as the run's, so an unmapped death reads as one
    def pid(self) -> int:
        return os.getpid()

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class TrainWorker:
    def pid(self) -> int:
        return os.getpid()

    def collective(self) -> None:
        raise RuntimeError("[gloo] Connection closed by peer")  # as when another rank died

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def _cluster(rollout, workers):
    from rlkit.config import load_recipe
    from rlkit.driver.cluster import Cluster

    root = Path(__file__).resolve().parents[2]
    c = Cluster(load_recipe(root / "recipes" / "grpo_tiny_ci.yaml"), "tiny", Path("/tmp/unused"))
    c.rollout_actor, c.trainer, c.engines = rollout, SimpleNamespace(workers=workers), []
    return c


def _rollout_actor_dead(ray):
    """A run's cluster whose rollout actor died (its death seen by a call), and a live rank."""
    rollout = ray.remote(RolloutActor).remote()
    rank = ray.remote(TrainWorker).remote()
    pid = ray.get(rollout.pid.remote())
    c = _cluster(rollout, [rank])
    rollout.die.remote()
    with pytest.raises(ray.exceptions.RayActorError) as err:
        ray.get(rollout.pid.remote())
    return c, rank, pid, err.value


def test_the_dead_actor_a_call_names_is_the_process_that_died(ray_session):
    ray = ray_session
    c, rank, pid, error = _rollout_actor_dead(ray)
    death = actor_death(error)
    assert death is not None and death.pid == pid and death.class_name == "RolloutActor"
    died = c.died(error, "the rollout")
    assert isinstance(died, ProcessDied) and died.exit_code == 1
    assert str(died).startswith(f"the rollout actor (pid {pid}) died during the rollout (its process "
                                "is gone, Ray's exit type ")
    assert c.died(ValueError("a bug"), "training") is None  # not a death: it keeps its traceback
    ray.kill(rank)


def test_a_death_found_elsewhere_first_is_named_by_asking_the_run_s_actors(ray_session):
    """The rollout actor is dead, and the error the driver gets first is another actor's task
    failing for it (a rank's broken collective): Ray's error names no dead actor; the run's
    actors are asked, and the dead one is named."""
    ray = ray_session
    c, rank, pid, _ = _rollout_actor_dead(ray)
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(rank.collective.remote())
    assert actor_death(err.value) is None
    died = c.died(err.value, "training")
    assert died is not None and str(died).startswith(f"the rollout actor (pid {pid}) died during training")
    assert ray.get(rank.pid.remote())  # the rank lives
    ray.kill(rank)


def test_an_actor_the_run_no_longer_holds_is_named_by_its_kind(ray_session):
    """A trainer rank that died while its group started: the group is gone, Ray's error names
    the class."""
    ray = ray_session
    rank = ray.remote(TrainWorker).remote()
    pid = ray.get(rank.pid.remote())
    rank.die.remote()
    with pytest.raises(ray.exceptions.RayActorError) as err:
        ray.get(rank.pid.remote())
    died = _cluster(None, []).died(err.value, "start-up")
    assert str(died).startswith(f"a trainer rank (pid {pid}) died during start-up (")


def test_no_death_is_looked_for_in_an_error_the_user_can_fix_or_a_stopped_run():
    """A bad data file is not a death; and once the run's Ray is stopped, nothing is asked: a
    Ray call then starts a new Ray (and writes ~/.ray/auth_token, as a failed start did)."""
    ray = pytest.importorskip("ray")
    from rlkit.data.errors import DataError

    class FromRay(Exception):  # what Ray raises (a task's error, a lost object)
        pass

    FromRay.__module__ = "ray.exceptions"
    started = ray.is_initialized()
    c = _cluster(None, [])
    wrapped = FromRay("task failed")
    wrapped.cause = DataError("prompts.jsonl: no such file")
    assert c.died(wrapped, "start-up") is None
    assert c.died(FromRay("object lost"), "the rollout") is None
    assert ray.is_initialized() == started
