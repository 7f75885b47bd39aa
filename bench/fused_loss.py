"""The loss alone: plain full-logits cross-entropy, the former chunked loss (ca7232f, head matmul redone in backward)
and the fused one, forward + backward of 2,048 positions × hidden 256, 1 thread, rounds interleaved.
Usage: python bench/fused_loss.py VOCAB"""
import time, torch, torch.nn.functional as F, sys
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1]))
torch.set_num_threads(1)
from nanoflow.loss import cross_entropy_sum
import subprocess
old_src = subprocess.run(['git','-C',str(__import__('pathlib').Path(__file__).resolve().parents[1]),'show','ca7232f:nanoflow/loss.py'],capture_output=True,text=True).stdout
ns = {}; exec(compile(old_src,'old_loss','exec'), ns)
old = ns['cross_entropy_sum']
V = int(sys.argv[1]); N=2048; H=256
g = torch.Generator().manual_seed(0)
hidden = torch.randn(N, H, generator=g).requires_grad_(); weight = (torch.randn(V, H, generator=g)*0.02).requires_grad_()
labels = torch.randint(0, V, (N,), generator=g)
def plain(): return F.cross_entropy((hidden @ weight.t()).float(), labels, reduction='sum')
fns = {'plain': plain, 'old chunked': lambda: old(hidden, weight, labels, -100), 'fused': lambda: cross_entropy_sum(hidden, weight, labels, -100)}
times = {k: [] for k in fns}
for r in range(3):
    for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
        hidden.grad = weight.grad = None
        t = time.perf_counter(); (fns[k]() / N).backward(); times[k].append(time.perf_counter() - t)
for k, v in times.items(): print(V, k, f"{min(v):.3f}s", f"/plain {min(v)/min(times['plain']):.3f}")
