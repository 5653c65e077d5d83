"""The placeholder dataset verl's dataloader reads to pace steps.

With the sampler doing all rollout, verl's dataloader only decides *how many* prompts a
step asks for (train_batch_size); which prompts, and from which domains, is the sampler's
business (its data files and mixer). verl still needs a parquet file in its RL-dataset
format, so this writes one with `rows` trivial rows::

    python -m trainer_client.verl.pacing --out pacing.parquet --rows 1024

Make `rows` a multiple of train_batch_size, and set ``trainer.total_training_steps``
(an epoch of this file means nothing). Needs pandas and pyarrow (verl installs both).
"""

from __future__ import annotations

import argparse
from pathlib import Path

PLACEHOLDER = "(prompt served by the adaptive-rollout sampler)"


def write_pacing_dataset(path: str | Path, rows: int = 1024) -> Path:
    """Write `rows` placeholder rows in verl's RL-dataset format to `path` (parquet)."""
    import pandas as pd

    if rows < 1:
        raise ValueError("rows must be >= 1")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = pd.DataFrame(
        {
            "data_source": ["adaptive_rollout"] * rows,
            "prompt": [[{"role": "user", "content": PLACEHOLDER}] for _ in range(rows)],
            "ability": ["sampler"] * rows,
            "reward_model": [{"style": "rule", "ground_truth": ""} for _ in range(rows)],
            "extra_info": [{"index": i, "split": "pacing"} for i in range(rows)],
        }
    )
    frame.to_parquet(path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="parquet file to write")
    parser.add_argument(
        "--rows", type=int, default=1024, help="rows (a multiple of train_batch_size)"
    )
    args = parser.parse_args(argv)
    print(write_pacing_dataset(args.out, args.rows))


if __name__ == "__main__":
    main()
