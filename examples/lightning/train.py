"""Train the Liger-composed decoder (``liger_decoder.py``) with PyTorch Lightning.

    pip install lightning          # or pytorch_lightning
    python examples/lightning/train.py                       # tiny model; CPU (Triton interpreter) or GPU
    python examples/lightning/train.py --hidden-size 512 --layers 8 --steps 500 --seq-len 1024

Data: any local text file as byte tokens (default: the standard library's ``argparse.py``).
Without Lightning installed the script says so and exits with status 0 without training.
"""

import argparse
import os
import sys
import sysconfig

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl
    except ImportError:
        pl = None

SKIP_MESSAGE = ("examples/lightning/train.py: skipped - neither `lightning` nor `pytorch_lightning` is installed "
                "(pip install lightning). Nothing was trained.")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a Liger-composed decoder with Lightning")
    parser.add_argument("--data", default=os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"),
                        help="local text file (byte-level tokens)")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=176)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if pl is None:
        print(SKIP_MESSAGE)
        return 0

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger_kernel imports triton
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from liger_decoder import DecoderConfig, LigerDecoder

    class LigerLanguageModel(pl.LightningModule):
        def __init__(self, config: DecoderConfig, lr: float):
            super().__init__()
            self.model = LigerDecoder(config)
            self.lr = lr

        def training_step(self, batch, batch_index):
            loss = self.model(batch)
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.0)

    pl.seed_everything(args.seed)
    with open(args.data, "rb") as handle:
        data = handle.read()
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n_blocks = tokens.numel() // args.seq_len
    if n_blocks < args.batch_size:
        raise ValueError(f"{args.data} holds {tokens.numel()} bytes: too few for batch {args.batch_size} x "
                         f"seq {args.seq_len}")
    blocks = tokens[: n_blocks * args.seq_len].view(n_blocks, args.seq_len)
    loader = torch.utils.data.DataLoader(blocks, batch_size=args.batch_size, shuffle=True, drop_last=True)

    config = DecoderConfig(hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads)
    module = LigerLanguageModel(config, args.lr)
    on_gpu = torch.cuda.is_available()
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if on_gpu else "cpu",
        devices=1,
        precision="bf16-true" if on_gpu else "32-true",
        logger=False,
        enable_checkpointing=False,
        log_every_n_steps=1,
    )
    trainer.fit(module, loader)
    print(f"final train_loss {float(trainer.callback_metrics['train_loss']):.4f} after {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
