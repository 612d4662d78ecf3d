"""What a run's record shows beyond its scores, and the probes that record it.

cka.py        linear CKA between two representations (also a method's penalty)
probes.py     the representation probe: per layer, CKA of an earlier task's
              representation now against right after it was learned
sharpness.py  per expert of the newest MoE group: token share, gradient norm,
              top Hessian eigenvalue
plots.py      `cl-bench analyze`: the figures drawn from a record
cost.py       `cl-bench analyze --against`: two runs' stage costs
depth.py      do deep layers expand more than shallow ones (decision maps)
"""
