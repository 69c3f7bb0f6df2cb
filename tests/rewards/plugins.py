"""Reward functions used by the reward tests, good and bad."""


async def async_reward(sample, **kwargs):
    return 1.0 if sample.response else 0.0


def bad_reward(sample, **kwargs):
    if not sample.response:
        return 1 / 0
    return "yes"


def no_args():
    return 1.0


def misspelled_attribute(sample, **kwargs):
    # `respones` for `response`: 0.0 on every input, which check-reward must flag
    return 1.0 if "13" in getattr(sample, "respones", "") else 0.0
