"""``python -m megatron_oases.pretrain_gpt``: Megatron-LM pretraining with megatron_oases' flags.

A forwarder; the entry lives in ``megatron_oases.megatron_lm.pretrain_gpt`` (see docs/megatron_lm.md).
"""
import sys

from megatron_oases.megatron_lm.pretrain_gpt import main

if __name__ == "__main__":
    sys.exit(main())
