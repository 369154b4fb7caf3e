"""Each kind of parallelism, built from scratch on real ``torch.distributed`` ranks, one concept per file.

* ``dp``   data parallelism: naive, bucketed and overlapped gradient all-reduce; gradient accumulation
* ``zero`` ZeRO stages 1-3 / FSDP
* ``tp``   tensor parallelism (Megatron column/row parallel, sequence parallel)
* ``pp``   pipeline parallelism (stages and schedules)
* ``cp``   context parallelism: the ``ContextParallel`` wrapper; ``cp_attention`` its math (ring and
  all-gather attention, the log-sum-exp merge, contiguous and zig-zag layouts)
* ``ep``   expert parallelism (all-to-all dispatch and combine)

Every module talks through ``course_lib.comm`` so that the bytes each rank moves are logged, and is checked
against the single-process baseline of ``course_lib.train`` and against PyTorch's own implementation.
"""
