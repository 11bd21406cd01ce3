import torch, fp8fx
from torch import nn
from fp8fx import Fp8Backend
torch.manual_seed(0)
for shape in [(1, 512), (2, 17, 512)]:
    m = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 256, bias=False)).to("cuda", torch.bfloat16).eval()
    ref64 = None
    x = torch.randn(*shape, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        exact = m.double()(x.double()); m.to(torch.bfloat16)
    fp8fx.quantize_(m)
    ep = torch.export.export(m, (x,)).run_decompositions()
    prog = ep.module()
    for opts in [dict(), dict(fuse_horizontal=True, fuse_mlp=True)]:
        be = Fp8Backend(**opts); torch._dynamo.reset()
        with torch.no_grad():
            out = torch.compile(prog, backend=be)(x)
        err = ((out.double() - exact).norm() / exact.norm()).item()
        print(shape, opts, "rel err vs float64", round(err, 4), "sites", [(s.fqn, s.rewritten, s.kernel) for s in be.report.sites])
        assert err < 0.08 and all(s.rewritten for s in be.report.sites)
print("export-decomposed OK")
