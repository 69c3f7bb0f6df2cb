"""Sync reward functions that misbehave on purpose, chosen by the sample's label (module level,
so a reward worker process imports them by name)."""

import math
import os
import time
from fractions import Fraction

import numpy as np


def by_label(sample, **kwargs):
    what = sample.label
    if what == "spin":  # CPU-bound, never yields, never returns
        while True:
            pass
    if what == "sleep":
        time.sleep(3600)
    if what == "raise":
        raise ValueError("cannot grade this")
    if what == "exit":  # takes its worker process down with it
        os._exit(3)
    if what == "system_exit":
        raise SystemExit(2)
    return {
        "nan": math.nan, "inf": math.inf, "-inf": -math.inf, "np_nan": np.float64("nan"),
        "np_inf": np.float32("inf"), "str": "1.0", "none": None, "list": [1.0],
        "array": np.array([1.0]), "huge": 10**400, "generator": (x for x in ()),
        "true": True, "false": False, "np_true": np.bool_(True), "np_float": np.float32(0.25),
        "int": 2, "fraction": Fraction(1, 4),
    }.get(what, 0.5)


def spin_always(sample, **kwargs):
    while True:
        pass


def pid(sample, **kwargs):
    return float(os.getpid())
