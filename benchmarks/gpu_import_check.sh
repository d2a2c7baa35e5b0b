export PYTHONPATH=$PWD/src NCCL_NVLS_ENABLE=0
for i in 1 2; do
python -c "
import time; t=time.monotonic(); import torch, torch.distributed; print('plain', round(time.monotonic()-t,3))"
python -c "
import resilient_strategy, time
from resilient_strategy.machine.inspect import detect_facts; t=time.monotonic(); detect_facts(); print('inspect', round(time.monotonic()-t,3))
t=time.monotonic(); import torch, torch.distributed; print('after inspect', round(time.monotonic()-t,3))"
python -c "
import time; import resilient_strategy
t=time.monotonic(); import torch, torch.distributed; print('after rs import', round(time.monotonic()-t,3))"
python -c "
import time, os, cProfile, pstats, resilient_strategy
from resilient_strategy.machine.inspect import detect_facts; detect_facts()
pr=cProfile.Profile(); pr.enable(); import torch, torch.distributed; pr.disable()
pstats.Stats(pr).sort_stats('cumulative').print_stats(12)" 2>&1 | head -40
done
