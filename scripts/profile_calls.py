import time, numpy as np
t0=time.time()
from sparseblocks.layout import BlockLayout
from sparseblocks.kernels import bsmm
print("import", time.time()-t0, flush=True)
rng=np.random.default_rng(0)
for i in range(4):
    L=BlockLayout.random((3,3),0.5,seed=i,block_size=8)
    x=rng.standard_normal((17,24)).astype(np.float32); w=rng.standard_normal(L.w_shape).astype(np.float32)
    t=time.time(); y=bsmm.forward(x,w,L); print("forward", i, time.time()-t, flush=True)
    t=time.time(); y=bsmm.forward(np.ascontiguousarray(x.T),w,L,0); print("forward fa0", i, time.time()-t, flush=True)
    t=time.time(); y=bsmm.weight_grad(x,x,BlockLayout.dense((3,3),8)); print("wgrad", i, time.time()-t, flush=True)
import cProfile, pstats
L=BlockLayout.random((3,3),0.5,seed=9,block_size=8)
cProfile.run("bsmm.forward(x,w,L)", "/tmp/p.out")
pstats.Stats("/tmp/p.out").sort_stats("cumtime").print_stats(15)
