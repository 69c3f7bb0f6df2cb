"""Multi-turn recipes route each turn to the engine holding its prefix: rollout.router.policy
left unset becomes cache_aware when rollout.episode.generator is set (issue 32 item 4); a
policy the recipe sets is kept, and single-turn recipes keep round_robin."""

from pathlib import Path

import pytest
import yaml

from rlkit.config import load_recipe
from rlkit.config.loader import dump_recipe
from rlkit.config.schema import Recipe
from rlkit.rollout.http.router import Router

ROOT = Path(__file__).resolve().parents[2]
EPISODES = ["rollout.episode.generator=multi_turn", "rollout.episode.environment=calculator"]


def test_a_multi_turn_recipe_routes_cache_aware_unless_told_otherwise():
    assert load_recipe(None).rollout.router.policy == "round_robin"
    assert load_recipe(None, EPISODES).rollout.router.policy == "cache_aware"
    assert load_recipe(ROOT / "recipes" / "grpo_smollm2_tool.yaml").rollout.router.policy == "cache_aware"
    for policy in ("round_robin", "random", "power_of_two"):
        chosen = load_recipe(None, [*EPISODES, f"rollout.router.policy={policy}"])
        assert chosen.rollout.router.policy == policy


@pytest.mark.parametrize("overrides", [[], EPISODES])
def test_the_resolved_policy_survives_the_run_folders_recipe(overrides):
    recipe = load_recipe(None, overrides)
    again = Recipe.model_validate(yaml.safe_load(dump_recipe(recipe)))
    assert again.rollout.router.policy == recipe.rollout.router.policy


def test_the_router_is_started_with_it_balanced_past_two_requests():
    router = load_recipe(None, EPISODES).rollout.router
    argv = Router(router).argv(1, 2, ["http://127.0.0.1:3"])
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--balance-abs-threshold") + 1] == "2"
    # the recipe's own router arguments come later, and the router takes the last
    mine = load_recipe(None, [*EPISODES, "rollout.router.extra_args=['--balance-abs-threshold', '8']"])
    assert mine.rollout.router.extra_args == ["--balance-abs-threshold", "2", "--balance-abs-threshold", "8"]
    # a policy set explicitly gets the router's own thresholds
    for overrides in ([*EPISODES, "rollout.router.policy=cache_aware"], []):
        assert load_recipe(None, overrides).rollout.router.extra_args == []
