"""What every example shares: the command line (--real for the GPU size) and the device."""

from __future__ import annotations

import argparse

import torch


def parse(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--real", action="store_true",
        help="real sizes in bf16 on a GPU (default: a tiny configuration, under a minute on a CPU)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps")
    args = parser.parse_args()
    if args.real and not torch.cuda.is_available():
        parser.error("--real needs a CUDA device")
    args.device = torch.device("cuda" if args.real else "cpu")
    args.dtype = torch.bfloat16 if args.real else torch.float32
    return args
