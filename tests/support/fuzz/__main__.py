"""``python -m fuzz --format single|sharded [--seed S] [--count N | --case I]`` (run in tests/)."""

from __future__ import annotations

import argparse
import os
import tempfile

from fuzz.cases import Bases, make_case, run_case, run_many


def main() -> None:
    p = argparse.ArgumentParser(description="run fastpersist's fuzz cases")
    p.add_argument("--format", choices=["single", "sharded"], required=True)
    p.add_argument("--seed", type=int, default=14)
    p.add_argument("--case", type=int, default=None, help="run this case only, and keep its files")
    p.add_argument("--count", type=int, default=100)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fastpersist-fuzz-")
    bases = Bases(os.path.join(work, "bases"))
    if args.case is not None:
        case = make_case(bases, args.format, args.seed, args.case, work)
        print(case.mutation, case.where)
        print(run_case(bases, args.format, args.seed, args.case, work)[1:])
        return
    counts, failures = run_many(bases, args.format, args.seed, args.count, work)
    print(dict(counts))
    print("\n".join(failures))


if __name__ == "__main__":
    main()
