"""`rlkit view RUN`: a local web page over a run folder (Steps, Engines, Groups and samples,
Advice), live while the run writes it; `rlkit view --export-trace RUN OUT.json` writes the
run's timeline as a Chrome trace (Perfetto, chrome://tracing) instead.

The page is served on loopback only, at a random port unless --port, with a token in the URL
printed; everything it loads ships in the package (rlkit/view/static; no internet).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", help="run folder (from `rlkit train`, or a simulator timeline folder)")
    parser.add_argument("out", nargs="?", help="with --export-trace: the trace file to write")
    parser.add_argument("--export-trace", action="store_true",
                        help="write the engine and trainer spans as a Chrome trace event JSON "
                             "to OUT and exit (open it in ui.perfetto.dev or chrome://tracing)")
    parser.add_argument("--compare", metavar="RUN2",
                        help="another run's timeline drawn over this one's engines, step by step "
                             "(the simulator's prediction for the same recipe)")
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: a free one)")


def run(args: argparse.Namespace) -> int:
    from rlkit.view.run_data import RunData, ViewError

    try:
        data = RunData(args.run, compare=args.compare)
    except ViewError as e:
        print(f"rlkit: {e}")
        return 1
    if args.export_trace:
        if not args.out:
            print("rlkit: --export-trace needs the file to write: rlkit view --export-trace RUN OUT.json")
            return 1
        from rlkit.view.trace_export import write_trace

        n = write_trace(data, args.out)
        print(f"wrote {args.out} ({n} trace events): open it in https://ui.perfetto.dev or chrome://tracing")
        return 0
    if args.out:
        print("rlkit: a second path is the trace file of --export-trace")
        return 1
    from rlkit.view.server import serve

    serve(data, port=args.port, announce=lambda line: print(line, flush=True))
    return 0
