"""The training scripts that ``scripts/bad_day_probes.py`` starts (as a user would: through
``gridtrain run``, or plain ``python``). Each reports with ``say(...)``: one ``RESULT {json}``
line per call, tagged with the rank."""

PRELUDE = """
import hashlib, json, os, random, sys, time
import torch
import torch.distributed as dist
import gridtrain as gt

RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

def say(**result):
    print("RESULT " + json.dumps({"rank": RANK, **result}), flush=True)

def fill(model, value):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)

def digest(model):
    state = gt.full_state_dict(model)
    return hashlib.sha256(b"".join(state[k].numpy().tobytes() for k in sorted(state))).hexdigest()
"""

# argv: sharded|dense, seed. Attempt 0 saves epochs 1 and 2, damages epoch 2 at random (a byte
# flipped or a file cut short, in any of its files) and loses rank 1; attempt 1 must resume.
DAMAGED = """
SHARDED, SEED = sys.argv[1] == "sharded", int(sys.argv[2])

def damage(path):
    rnd = random.Random(SEED)
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    target = os.path.join(path, rnd.choice(names)) if names else path
    size = os.path.getsize(target)
    if rnd.random() < 0.5 and size:
        with open(target, "r+b") as f:
            f.seek(rnd.randrange(size))
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0xFF]))
        return f"flipped a byte of {target}"
    os.truncate(target, rnd.randrange(size) if size else 0)
    return f"cut {target} short"

ctx = gt.launch_from_torch(backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(gt.nn.Linear(16, 32), torch.nn.GELU(), gt.nn.Linear(32, 8))
engine, *_ = gt.initialize(
    model, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.nn.functional.mse_loss,
    example_inputs=torch.zeros(4, 16),
)
latest = gt.latest_checkpoint("ckpt") if os.path.isdir("ckpt") else None
first = gt.load_checkpoint(latest, engine.model, engine.optimizer) if latest else 0
say(attempt=ATTEMPT, resumed=os.path.basename(latest) if latest else None)
g = torch.Generator().manual_seed(1)
x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
for epoch in range(first, 3):
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
    path = f"ckpt/epoch_{epoch + 1}" + ("" if SHARDED else ".pt")
    gt.save_checkpoint(path, epoch + 1, engine.model, engine.optimizer, sharded=SHARDED)
    if ATTEMPT == 0 and epoch + 1 == 2:
        dist.barrier()
        if RANK == 0:
            say(damaged=damage(path))
        dist.barrier()
        if RANK == 1:
            os._exit(9)  # a lost rank: the agent restarts every rank
say(attempt=ATTEMPT, finished=True)
gt.destroy()
"""

# argv: the small disk's directory, the export's shard size. Each save replaces a smaller one
# with one the disk cannot hold.
DISK_FULL = """
from transformers import LlamaConfig, LlamaForCausalLM
import gridtrain.hf as gthf

disk, shard = sys.argv[1], sys.argv[2]
ctx = gt.launch_from_torch(backend="gloo")

def left():
    return [n for n in os.listdir(disk) if n.startswith(".")]

for name, sharded in (("dense.pt", False), ("sharded", True)):
    path = os.path.join(disk, name)
    small = torch.nn.Linear(4, 4)
    fill(small, 1.0)
    gt.save_checkpoint(path, 1, small, sharded=sharded)
    try:
        gt.save_checkpoint(path, 2, torch.nn.Linear(512, 512), sharded=sharded)  # 1 MB
        error = None
    except OSError as err:
        error = str(err)
    back = torch.nn.Linear(4, 4)
    fill(back, 0.0)
    whole = gt.load_checkpoint(path, back) == 1 and all(bool((p == 1).all()) for p in back.parameters())
    dist.barrier()
    say(save=f"save_checkpoint {name}", path=path, error=error, whole=whole, left=left())
    dist.barrier()

def llama(dtype):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)

path = os.path.join(disk, "hf")
old = llama(torch.bfloat16)  # about 210 KB
gthf.save_pretrained(old, path, max_shard_size=shard)
try:
    gthf.save_pretrained(llama(torch.float32), path, max_shard_size=shard)  # about 420 KB
    error = None
except OSError as err:
    error = str(err)
back = llama(torch.bfloat16)
fill(back, 0.0)
gthf.load_pretrained(back, path)
whole = all(torch.equal(a, b) for a, b in zip(old.parameters(), back.parameters()))
dist.barrier()
say(save="save_pretrained", path=path, error=error, whole=whole, left=left())
gt.destroy()
"""

# plain python, one process: save argv[1] over and over, every weight equal to the epoch
SAVER = """
path, sharded = sys.argv[1], sys.argv[2] == "sharded"
gt.launch_from_torch()
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
epoch = 0
while True:
    epoch += 1
    fill(model, float(epoch))
    gt.save_checkpoint(path, epoch, model, sharded=sharded)
    if epoch == 1:
        print("ready", flush=True)
"""

# argv: path, loads. Every rank loads it again and again while SAVER replaces it.
READER = """
path, loads = sys.argv[1], int(sys.argv[2])
ctx = gt.launch_from_torch(backend="gloo")
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
for _ in range(loads):
    try:
        epoch = gt.load_checkpoint(path, model)
        values = torch.cat([p.detach().flatten() for p in model.parameters()]).unique().tolist()
        seen = (epoch, values[:3])
    except Exception as err:
        seen = (None, f"{type(err).__name__}: {err}"[:200])
    every = [None, None]
    dist.all_gather_object(every, seen)
    if RANK == 0:
        say(seen=every)
gt.destroy()
"""

# plain python, one process (GRIDTRAIN_CONFIG: the fp16 section). argv: bad steps, seed.
# BAD steps whose loss is inf, then 3 finite ones.
OVERFLOW = """
import torch.nn.functional as F
from gridtrain.engine import NonFiniteLossError

bad, seed = int(sys.argv[1]), int(sys.argv[2])
ctx = gt.launch_from_torch()
torch.manual_seed(seed)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
engine, *_ = gt.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
x, y = torch.randn(4, 8), torch.randn(4, 1)
done, error, before = 0, None, None
try:
    for step in range(bad + 3):
        if step == bad:
            before = digest(engine.model)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x * float("inf") if step < bad else x), y))
        engine.step()
        done += 1
except NonFiniteLossError as err:
    error = str(err)
finite = all(bool(torch.isfinite(p).all()) for p in gt.full_state_dict(engine.model).values())
moved = before is not None and digest(engine.model) != before
say(done=done, error=error, finite=finite, moved=moved)
"""

# argv: the step after which attempt 0 loses rank 1 (0: never). A checkpoint every 2 steps;
# a resume fast-forwards the loader to the saved step, as demos/gpt/train.py does.
DROPOUT = """
from torch.utils.data import TensorDataset

STEPS, EVERY, crash = 8, 2, int(sys.argv[1])
ctx = gt.launch_from_torch(backend="gloo")
g = torch.Generator().manual_seed(3)
data = TensorDataset(torch.randn(48, 16, generator=g), torch.randint(8, (48,), generator=g))
loader = gt.data.get_dataloader(data, 4, shuffle=True, seed=5)
torch.manual_seed(7)
model = torch.nn.Sequential(
    gt.nn.Linear(16, 32), torch.nn.GELU(), gt.nn.Dropout(0.2), gt.nn.Linear(32, 16),
    gt.nn.LayerNorm(16), gt.nn.Classifier(16, 8),
)
engine, *_ = gt.initialize(
    model, torch.optim.AdamW(model.parameters(), lr=1e-2), gt.nn.CrossEntropyLoss(),
    example_inputs=torch.zeros(4, 16),
)
first = 0
latest = gt.latest_checkpoint("ckpt") if os.path.isdir("ckpt") else None
if latest:
    extra = {}
    gt.load_checkpoint(latest, engine.model, engine.optimizer, extra=extra)
    first = extra["step"]

def forever():
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1

batches = forever()
for _ in range(first):
    next(batches)
losses = {}
engine.train()
for step in range(first, STEPS):
    x, y = next(batches)
    engine.zero_grad()
    loss = engine.criterion(engine(x), y)
    engine.backward(loss)
    engine.step()
    losses[step] = loss.item()
    if (step + 1) % EVERY == 0:
        extra = {"step": step + 1}
        gt.save_checkpoint(f"ckpt/step_{step + 1}", 0, engine.model, engine.optimizer, sharded=True, extra=extra)
    if ATTEMPT == 0 and step + 1 == crash and RANK == 1:
        os._exit(9)
say(attempt=ATTEMPT, first=first, losses=losses, digest=digest(engine.model))
gt.destroy()
"""

# DataLoader workers of both kinds on every rank, then train forever
WORKERS = """
class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 10**6

    def __getitem__(self, i):
        return os.getpid()

ctx = gt.launch_from_torch(backend="gloo")
ours = iter(gt.data.get_dataloader(Pids(), 1, num_workers=2))
plain = iter(torch.utils.data.DataLoader(Pids(), batch_size=1, num_workers=1))
workers = {int(next(ours)[0]) for _ in range(4)} | {int(next(plain)[0])}
say(pids=[os.getpid(), *sorted(workers)])
while True:
    dist.all_reduce(torch.ones(1))
    time.sleep(0.05)
"""

SHOW_ARGV = "import json, sys\nprint('ARGV ' + json.dumps(sys.argv[1:]), flush=True)\n"

# plain python, no context. argv: export directory, variant, work directory.
HF_LOAD = """
import shutil
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
import gridtrain.hf as gthf

export, variant, work = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
INDEX = "model.safetensors.index.json"

def llama():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(config)

if variant == "save":
    torch.manual_seed(0)
    gthf.save_pretrained(llama(), export, max_shard_size="20KB")
    raise SystemExit(0)
directory = work / "model"
shutil.copytree(export, directory)
index = json.loads((directory / INDEX).read_text())
shards = sorted(set(index["weight_map"].values()))
shutil.copy(directory / shards[0], work / "outside.safetensors")
key = sorted(index["weight_map"])[0]
names = {
    "dotdot": "../outside.safetensors",
    "dotdot-deep": "sub/../../outside.safetensors",
    "dot-dotdot": "./../outside.safetensors",
    "absolute": str(work / "outside.safetensors"),
    "link-out": "link.safetensors",
    "fifo": "pipe.safetensors",
    "directory": "sub",
    "device": "/dev/zero",
}
if variant == "link-out":
    os.symlink(work / "outside.safetensors", directory / "link.safetensors")
if variant == "fifo":
    os.mkfifo(directory / "pipe.safetensors")
if variant == "directory":
    (directory / "sub").mkdir()
if variant == "fifo-single":
    directory = work / "single"
    directory.mkdir()
    os.mkfifo(directory / "model.safetensors")
    name = "model.safetensors"
elif variant == "truncated":
    name = shards[-1]
    os.truncate(directory / name, (directory / name).stat().st_size // 2)
else:
    name = names[variant]
    index["weight_map"][key] = name
    (directory / INDEX).write_text(json.dumps(index))
try:
    gthf.load_pretrained(llama(), directory)
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
say(name=name, error=error)
"""
