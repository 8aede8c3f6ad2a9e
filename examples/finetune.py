"""Fuyou's main job: fine-tune a GPT-style model with every optimizer state byte on SSD.

Starts a private fuyoud (embedded defaults, state under .fuyou/finetune) unless
--socket names a running one, builds a GPT-2 architecture of about 60M parameters
(random initialisation; --model PATH loads any local `from_pretrained` directory),
attaches it to the daemon (fp32 master weights and AdamW moments live on the SSD array,
each layer group is stepped by the daemon while backward goes on), trains on the small
public-domain corpus in examples/data/, shows loss, tokens/s and SSD traffic, and
exports the result with `engine.export` (safetensors shards streamed from the SSD array,
one layer group at a time; `from_pretrained` loads the directory).

    python examples/finetune.py [--steps 60] [--model PATH] [--out DIR] [--socket PATH]
                                [--state-dtype fp32|bf16|int8] [--losses FILE.json] [--trainer]
                                [--block-major K]

--state-dtype is what the AdamW moments are kept in on the SSD (master weights stay fp32):
fp32 (exact, 24 SSD bytes per parameter per step), bf16 (16) or block-wise int8 (about
12.06); docs/guide/state-dtype.md has the loss curves of each against fp32. --losses writes
every step's loss (and the settings) as JSON. --trainer trains the same model on the same
corpus through Hugging Face's Trainer instead of the hand-written loop (FuyouTrainer:
fuyou_client/integrations/transformers.py; the same schedule, warm-up then cosine).
--block-major K trains K micro-batches of --batch sequences per step with
`engine.train_step` (block-major order: each block's weights and gradients cross once per
step, not once per micro-batch; docs/guide/gpu.md).

Under torchrun (``./run.sh demo --nproc 2``, or ``torchrun --nproc-per-node 2
examples/finetune.py``) every rank trains on its own batches, data parallel: each keeps
its shard of the optimizer state in its host's daemon (local rank 0 starts a private one
per host unless --socket or $FUYOUD_SOCKET names one), gradients are reduce-scattered and
weights all-gathered (docs/guide/distributed.md); each block's weights are read (this
rank's shard) and gathered as it computes. With --optimizer-host (``./run.sh demo --nproc 3
--optimizer-host``) the last rank is the optimizer host instead: it keeps every optimizer
state and master weight in its daemon, the other ranks are workers that hold none
(docs/guide/optimizer-host.md).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import socket as socketlib
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import fuyou_client

ROOT = Path(__file__).resolve().parent.parent


class ByteTokenizer:
    """Bytes as tokens: no vocabulary to download, any text works."""
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def load_model(args):
    import transformers

    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
        tok = transformers.AutoTokenizer.from_pretrained(args.model)
        return model, (lambda text: tok(text)["input_ids"])
    tok = ByteTokenizer()
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=args.seq, n_embd=args.width,
                                  n_layer=args.layers, n_head=args.width // 64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg), tok.encode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--model", help="a local Hugging Face model directory (default: random GPT-2 architecture)")
    ap.add_argument("--corpus", default=str(ROOT / "examples" / "data" / "corpus.txt"))
    ap.add_argument("--out", default=str(ROOT / ".fuyou" / "finetuned"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the model computes (default: cuda if available, else cpu)")
    ap.add_argument("--bf16", action="store_true", help="bf16 compute (fp32 master weights and moments on SSD)")
    ap.add_argument("--state-dtype", default="fp32", choices=("fp32", "bf16", "int8"),
                    help="what the AdamW moments are kept in on the SSD (default fp32, exact; bf16 and int8 "
                         "move fewer bytes per step, see docs/guide/state-dtype.md)")
    ap.add_argument("--losses", help="write every step's loss to this JSON file")
    ap.add_argument("--socket", help="use the fuyoud at this control socket instead of a private one")
    ap.add_argument("--state-dir", default=str(ROOT / ".fuyou" / "finetune"))
    ap.add_argument("--trainer", action="store_true", help="train through Hugging Face's Trainer (FuyouTrainer)")
    ap.add_argument("--block-major", type=int, default=0, metavar="K",
                    help="K micro-batches of --batch sequences per step through engine.train_step")
    ap.add_argument("--optimizer-host", action="store_true",
                    help="under torchrun: the last rank is the optimizer host (serve_optimizer: every optimizer state "
                         "and master weight in its daemon), the others workers that hold none")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        if args.device == "cuda":
            args.device = f"cuda:{local}"
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        if args.socket is None:
            args.socket = os.environ.get("FUYOUD_SOCKET")
        if args.trainer or args.block_major:
            ap.error("--trainer and --block-major train one process; under torchrun use the plain loop")
    if args.optimizer_host and world < 2:
        ap.error("--optimizer-host needs torchrun with two ranks at least (workers, then the optimizer host)")
    host = [world - 1] if args.optimizer_host else None  # (optimizer_ranks)
    trainers = world - 1 if host else world  # (the ranks that train on batches)
    quiet = rank != 0

    model, encode = load_model(args)
    model = model.to(torch.bfloat16 if args.bf16 else torch.float32).to(args.device)
    params = sum(p.numel() for p in model.parameters())
    tokens = torch.tensor(encode(Path(args.corpus).read_text()), dtype=torch.long)
    opt = fuyou_client.AdamW(lr=args.lr, weight_decay=0.01, state_dtype=args.state_dtype)
    per_param = {"fp32": 12, "bf16": 8, "int8": 6 + 8 / 256}[args.state_dtype]  # fuyoud/optimizer/layout.py
    how_many = (f" x {trainers} workers and an optimizer host" if host
                else f" x {world} ranks (data parallel)" if world > 1 else "")
    if not quiet:
        print(f"model: {type(model).__name__}, {params / 1e6:.1f}M parameters on {args.device}"
              f"{how_many}; corpus: {len(tokens)} tokens; optimizer "
              f"state on SSD ({args.state_dtype} moments): {params * per_param / 2**30:.2f} GiB", flush=True)

    daemon = None
    if args.socket is None:
        daemon, args.socket = private_daemon(args, world, local)
    try:
        if args.trainer:
            return with_trainer(args, model, tokens, args.socket)
        if host is not None and rank in host:  # the optimizer host: steps the workers' gradients until they close
            served = fuyou_client.serve_optimizer(model, opt, optimizer_ranks=host, socket=args.socket,
                                                  namespace="finetune-demo")
            print(f"optimizer host (rank {rank}): {served.steps} group steps served", flush=True)
            return 0
        extra = {"optimizer_ranks": host, "offload": False} if host is not None else {}
        engine = fuyou_client.attach(model, opt, socket=args.socket, namespace="finetune-demo", max_grad_norm=None,
                                     **extra)
        if not quiet:
            print(engine.memory_plan(), flush=True)  # (the shared buffers it took, planned from the daemon's budget)
        sched = torch.optim.lr_scheduler.LambdaLR(
            engine.optimizer, lambda s: min(1.0, (s + 1) / 5) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
        gen = torch.Generator().manual_seed(rank)  # (each rank its own batches)
        start = engine.session.status()
        first = last = None
        losses = []
        t0 = time.perf_counter()
        bar = tqdm(range(args.steps), desc="fine-tuning", unit="step", dynamic_ncols=True, disable=quiet)
        micro = max(1, args.block_major)

        def draw():
            idx = torch.randint(0, len(tokens) - args.seq - 1, (args.batch,), generator=gen)
            return torch.stack([tokens[i:i + args.seq] for i in idx]).to(args.device)
        for step in bar:
            if args.block_major:
                batches = [draw() for _ in range(micro)]
                last = engine.train_step(batches, lambda b: model(b, labels=b).loss / micro).sum().item()
            else:
                batch = draw()
                loss = model(batch, labels=batch).loss
                loss.backward()
                engine.step()
                engine.zero_grad()
                last = loss.item()
            sched.step()
            losses.append(last)
            first = last if first is None else first
            st = engine.session.status()
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{last:.3f}",
                            tok_s=f"{(step + 1) * micro * args.batch * args.seq * trainers / elapsed:.0f}",
                            ssd_read=f"{(st.bytes_read - start.bytes_read) / 1e9:.2f}GB",
                            ssd_written=f"{(st.bytes_written - start.bytes_written) / 1e9:.2f}GB")
        bar.close()
        elapsed = time.perf_counter() - t0
        if args.losses and not quiet:  # (before the export: the curve is the point of a quality run)
            tail = losses[-10:]
            Path(args.losses).write_text(json.dumps({
                "state_dtype": args.state_dtype, "steps": args.steps, "batch": args.batch, "seq": args.seq,
                "layers": args.layers, "width": args.width, "lr": args.lr, "model": args.model, "params": params,
                "final_loss": last, "mean_last_10": sum(tail) / len(tail), "losses": losses, "seconds": elapsed,
                "argv": sys.argv}, indent=1) + "\n")
        out = engine.export(Path(args.out))
        engine.close(materialize=False)
        how = f", {micro} micro-batches per step in block-major order" if args.block_major else ""
        how += (f", {world - 1} workers and an optimizer host" if host is not None
                else f", {world} ranks, data parallel" if world > 1 else "")
        if quiet:
            return 0
        print(f"loss {first:.3f} -> {last:.3f} in {args.steps} steps ({elapsed:.0f} s, {args.state_dtype} moments{how}); "
              f"fine-tuned weights saved to {out} (safetensors)")
        if not last < first:
            print("WARNING: the loss did not fall", file=sys.stderr)
            return 1
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.barrier()  # (every rank is done with the daemon before it stops)
        if daemon is not None:
            daemon.stop()
            shutil.rmtree(daemon_dir(args, world), ignore_errors=True)
            daemon_dir(args, world).with_suffix(".socket").unlink(missing_ok=True)
        if world > 1:  # the process group ends before the interpreter does (docs/guide/distributed.md)
            gc.collect()
            dist.destroy_process_group()
            gc.collect()
    return 0


def daemon_dir(args, world: int) -> Path:
    """The private daemon's state: per host under torchrun (local rank 0 runs it)."""
    if world == 1:
        return Path(args.state_dir)
    return Path(args.state_dir) / f"{socketlib.gethostname()}-{os.environ.get('GROUP_RANK', '0')}"


def private_daemon(args, world: int, local: int):
    """(daemon or None, its socket): local rank 0 starts it and announces its socket in a
    file; the other ranks of the host read it after a barrier."""
    where = daemon_dir(args, world)
    announce = where.with_suffix(".socket")
    daemon = None
    if local == 0:
        shutil.rmtree(where, ignore_errors=True)
        daemon = fuyou_client.start_daemon(where)  # (its defaults: the data file grows as the state needs)
        announce.write_text(str(daemon.socket))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return daemon, str(daemon.socket) if daemon is not None else announce.read_text()


def with_trainer(args, model, tokens, socket: str) -> int:
    """The same fine-tuning through Hugging Face's Trainer: FuyouTrainer with the loop's
    settings (warm-up over 5 steps then cosine, weight decay 0.01, no clipping)."""
    import transformers
    from fuyou_client.integrations.transformers import FuyouTrainer

    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(tokens) - args.seq - 1, (args.steps * args.batch,), generator=gen)
    rows = [{"input_ids": tokens[i:i + args.seq], "labels": tokens[i:i + args.seq]} for i in starts]
    targs = transformers.TrainingArguments(
        output_dir=str(Path(args.state_dir) / "trainer"), max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, weight_decay=0.01, lr_scheduler_type="cosine", warmup_steps=5, max_grad_norm=0.0,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=args.device == "cpu", bf16=args.bf16,
        dataloader_num_workers=0, seed=0)
    trainer = FuyouTrainer(model=model, args=targs, train_dataset=rows, state_dtype=args.state_dtype,
                           fuyou={"socket": socket, "namespace": "finetune-demo"})
    t0 = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - t0
    print(trainer.engine.memory_plan(), flush=True)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    trainer.save_model(args.out)
    trainer.engine.close(materialize=False)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps through FuyouTrainer ({elapsed:.0f} s, "
          f"{args.state_dtype} moments); fine-tuned weights saved to {args.out} (safetensors)")
    if args.losses:
        Path(args.losses).write_text(json.dumps({"trainer": True, "state_dtype": args.state_dtype,
                                                 "losses": losses, "seconds": elapsed}, indent=1) + "\n")
    if not losses[-1] < losses[0]:
        print("WARNING: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
