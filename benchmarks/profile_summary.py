"""Where a server's threads held the GIL: a summary of a py-spy speedscope profile (``load_bench.py --py-spy C``).

Per thread, the seconds sampled (py-spy ``--gil``: only stacks holding the GIL), then the functions of this package
(or of files matching --match) with the most inclusive time: a function's share counts every sample with it anywhere
on the stack, once. Prints Markdown.

    python benchmarks/profile_summary.py OUT/load_pair/ddtree.c32.speedscope.json [--top 15] [--match ddtree_jax]
"""

from __future__ import annotations

import argparse
import collections
import json


def summarize(profile: dict, match: str = "ddtree_jax", top: int = 15) -> str:
    frames = profile["shared"]["frames"]
    lines = []
    for p in profile["profiles"]:
        total = sum(p["weights"])
        inclusive: collections.Counter[str] = collections.Counter()
        for stack, w in zip(p["samples"], p["weights"]):
            names = {f"{frames[i]['name']} ({frames[i]['file'].rsplit('/', 1)[-1]})"  # py-spy's frames are lines
                     for i in stack if match in frames[i]["file"]}
            for name in names:
                inclusive[name] += w
        lines += [f"### {p['name']}: {total:.2f} s holding the GIL", "", "| function | s | share |", "| --- | ---: | ---: |"]
        lines += [f"| {name} | {s:.2f} | {s / total:.0%} |" for name, s in inclusive.most_common(top)]
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", help="a speedscope JSON file written by py-spy")
    p.add_argument("--match", default="ddtree_jax", help="the functions listed: those of files whose path holds this")
    p.add_argument("--top", type=int, default=15, help="functions listed per thread")
    args = p.parse_args(argv)
    with open(args.profile) as f:
        print(summarize(json.load(f), args.match, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
