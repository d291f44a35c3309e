"""Adam8bit as a drop-in for torch.optim.Adam: change one line, keep the loop.  python examples/adam8bit_dropin.py"""

import torch

import lowbit.optim

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10))
x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
opt = lowbit.optim.Adam8bit(model.parameters(), lr=1e-3)  # was: torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(200):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
state = sum(t.nbytes for s in opt.state.values() for t in s.values())
print(f"loss {loss.item():.4f} after 200 steps; optimizer state {state:,} bytes (torch.optim.Adam: 8 per parameter)")
