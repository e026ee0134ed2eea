"""``python -m eagle3_assets.core.training --config launch_config.json``: one training process (the torchrun worker).

Run alone it trains in this process; under ``torchrun`` (``python -m
torch.distributed.run ... -m eagle3_assets.core.training --config ...``) every
process runs it, on one node or several (docs/training.md).
"""

from eagle3_assets.core.training.launch import main

if __name__ == "__main__":
    main()
