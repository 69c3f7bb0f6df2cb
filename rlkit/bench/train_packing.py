"""`rlkit bench train`, packing: forward+backward seconds of one batch in each packing layout.

In this process (TP=1), forward+backward of the same batch in three layouts: packed
into rows as long as the micro-batch's longest sample (the default), packed into rows of up to
2048 tokens, and padded (one row per sample); alternated round-robin so that load changes on a
shared machine hit all alike. Ratios of the fastest rounds to the padded one are the figures
(medians in the JSON).
"""

from __future__ import annotations

import statistics
import time

from rlkit.bench.train_inputs import SHAPES, synthetic_batch

PACKING_LAYOUTS = {  # name -> (packing, pack_row_tokens)
    "packed-longest": (True, 0),
    "packed-2048": (True, 2048),
    "padded": (False, 0),
}


def compare_packing(path: str, name: str, rounds: int) -> dict:
    """Median fwd+bwd seconds of the batch in each layout, alternated in one trainer."""
    from rlkit.train.config import TrainConfig
    from rlkit.train.hf_io import read_config
    from rlkit.train.megatron.trainer import MegatronTrainer
    from rlkit.train.packing import pack_samples

    batch = synthetic_batch(int(read_config(path)["vocab_size"]), *SHAPES[name])
    trainer = MegatronTrainer.single_process(path, TrainConfig(device="cpu", micro_batch_size=8))
    times: dict[str, list[float]] = {k: [] for k in PACKING_LAYOUTS}
    padding: dict[str, float] = {}
    for layout, (pack, row_tokens) in PACKING_LAYOUTS.items():  # fixed per layout: pack once
        rows = [
            pack_samples([s.tokens for s in m.samples], [s.prompt_length for s in m.samples], row_tokens, pack=pack)
            for m in batch.micro_batches(trainer.config.micro_batch_size)
        ]
        padding[layout] = 1 - sum(r.tokens for r in rows) / sum(r.slots for r in rows)
    for _ in range(rounds):
        for layout, (pack, row_tokens) in PACKING_LAYOUTS.items():
            trainer.config.packing, trainer.config.pack_row_tokens = pack, row_tokens
            t = time.perf_counter()
            trainer.accumulate(batch)
            times[layout].append(time.perf_counter() - t)
            trainer.discard_gradients()
    best = {k: min(v) for k, v in times.items()}
    return {
        "model": name, "tokens": batch.tokens, "rounds": rounds,
        "layouts": {
            k: {"seconds": best[k], "seconds_median": statistics.median(times[k]),
                "tokens_per_s": batch.tokens / best[k], "padding_fraction": padding[k],
                "speedup_vs_padded": best["padded"] / best[k]}
            for k in PACKING_LAYOUTS
        },
    }


def table_lines(results: list[dict]) -> list[str]:
    lines = ["packing (TP=1, fwd+bwd, alternated)   layout          pad%  best s   tok/s   vs padded"]
    for r in results:
        for layout, v in r["layouts"].items():
            lines.append(
                f"{r['model']:<16} {r['tokens']:>6} tokens        {layout:<15} {100 * v['padding_fraction']:5.1f} "
                f"{v['seconds']:8.2f} {v['tokens_per_s']:7.1f} {v['speedup_vs_padded']:8.2f}x"
            )
    return lines
