"""Each kind of parallelism, built from scratch on real ``torch.distributed`` ranks, one concept per file.

* ``dp``        data parallelism: naive, bucketed and overlapped gradient all-reduce; gradient accumulation
* ``zero``      ZeRO stages 0-3 / FSDP over flat parameters (FSDP1 / DeepSpeed form)
* ``zero_unit`` one flat-parameter unit; ``zero_checkpoint`` sharded checkpoints of ``zero``: save at N
  ranks, load at any N or in one process; ``zero_accounting`` model-state bytes measured and comm bytes exact
* ``fsdp_torch`` PyTorch's FSDP2 (``fully_shard``) behind the wrapper contract, the oracle for ``zero``/``fsdp2``
* ``fsdp2``     FSDP2's contract on the same engine: the module's parameters are their dim-0 shards, mixed
  precision (16-bit compute, fp32 master shards, a reduce dtype), FSDP + TP on the TP-local tensors
* ``sharded_optimizer`` ZeRO-1 at the optimizer level (``ShardedOptimizer``, ``ZeroRedundancyOptimizer``'s shape)
* ``pp``        pipeline parallelism (the ``PipelineParallel`` wrapper, schedules run on real ranks, ``train_pp``),
  ``pp_stages`` the plan and the stages, ``pp_executor`` the executor of one rank's actions, ``pp_split`` the
  I/W backward split, ``pp_balance`` stage balancing from measured costs (the layer-split rule they share with
  ``memory`` is ``course_lib.parallel.pp_layers``), ``pp_fsdp`` ZeRO-3 / FSDP2 of the stages driven by the schedule's
  actions (gradients accumulated over the micro-batches, one reduce-scatter per step)
* ``contract``  the base class of every wrapper; ``loop`` the one training loop every ``train_xx`` runs
* ``placement`` where each parameter lives on every mesh axis (``Replicate``, ``Shard(dim)``, ``Partial``, recorded
  by each transform) and the generic functions that read it: whole parameters, gradient-norm clipping with each
  shard counted once, partial-gradient reduction, the cut of a whole tensor (checkpoints)
* ``tp``        tensor parallelism: the plan, the ``TensorParallel`` wrapper, ``train_tp``; ``tp_layers`` its
  layers (Megatron column/row parallel, attention by heads, MLP, vocab-parallel embedding and loss);
  ``tp_comm`` the f/g operators and their sequence-parallel pair; ``tp_accounting`` a step's collectives and
  activations on paper; ``tp_dtensor`` DTensor's plan and comm log (the oracle)
* ``cp``        context parallelism: the ``ContextParallel`` wrapper; ``cp_attention`` its math (ring and
  all-gather attention, the log-sum-exp merge, contiguous and zig-zag layouts)
* ``ep``        expert parallelism (count exchange, all-to-all dispatch and combine)
  ``moe_mesh`` an MoE's capacity, queues and router losses on any mesh (dp, cp, pp) as on one process
* ``transforms`` each axis as an in-place transform of the model (``apply_tp``, ``apply_cp``, ``apply_ep``,
  ``apply_pp``, ``apply_data_parallel``), each recording its placements;
* ``compose``   ``parallelize(model, mesh)``: those transforms in the order TP -> CP -> EP -> PP -> DP / ZeRO on one
  mesh, ``train_parallel``;
  ``config`` the ``ParallelConfig`` that describes a composed run (degrees, order, options) in one value;
  ``mesh_checkpoint`` saves a composed run at one mesh and resumes it at another

Every module talks through ``course_lib.comm`` so that the bytes each rank moves are logged, and is checked
against the single-process baseline of ``course_lib.train`` and against PyTorch's own implementation.

The wrapper contract
--------------------
Every parallelism (these, and tensor, context and expert parallelism) wraps a model the same way, so that
they compose on one ``course_lib.runtime.mesh.Mesh`` of ranks and one training loop drives them all:

* ``Wrapper(module, *, mesh=None, group=None, ...)`` is an ``nn.Module`` (a ``contract.ParallelWrapper``).
  ``mesh=`` resolves to ``mesh.group(*Wrapper.axes)`` (DP: ``"dp"``; ZeRO/FSDP: ``"dp", "cp"``; the pipeline:
  ``"pp"``; TP: ``"tp"``; CP: ``"cp"``, its gradients averaged over ``"dp", "cp"``; EP: ``"dp", "cp"``, its
  all-to-alls over ``"ep"``); ``group=`` is a process group (None = every rank); not both. A rank outside the
  group gets a clear ``ValueError`` at construction. ``forward`` runs the module (the pipeline, whose forward and
  backward interleave over micro-batches, runs one pass of its schedule in ``forward_backward(x, y)`` instead;
  CP's ``forward_backward`` takes full sequences and cuts this rank's tokens). ``loss(logits, targets)`` is the
  loss of the form's outputs, what the loop uses by default (the LM loss; TP's vocab-parallel cross-entropy; EP
  adds the router losses, which depend on the whole batch of a forward: ``batch_wide_loss``).
* ``parameters()`` are what this rank's optimizer steps: the replica's (DP), the flat shards (ZeRO; for FSDP2 the
  per-parameter shards, which are then also the module's own ``parameters()``), this rank's stages' (pipeline).
  Where the form replicates weights, the constructor broadcasts them from the group's first rank, so replicas
  start identical however each rank initialised its model.
* ``no_sync()``: the forward/backward passes inside it only accumulate gradients locally; the next one outside
  it reduces the sum (DP: no all-reduce; ZeRO: no reduce-scatter -- stage 3 still gathers its parameters; the
  pipeline: nothing to hold back, it accumulates its own micro-batches; TP, CP and EP: their layers still
  communicate -- f and g, the ring, the all-to-alls are part of the math -- only the gradient reduction waits).
* ``finish_gradient_sync()`` after the last backward, before ``optimizer.step()`` (DP waits for / runs its
  all-reduces); ``after_step()`` after ``optimizer.step()`` (ZeRO 1/2 all-gather the updated shards). Either
  is a no-op where a form has nothing to do then, but both exist, so one loop drives every form.
* ``remove_hooks()`` removes every hook the wrapper installed (ZeRO-3 first gathers the parameters back).
* Seams: what a variant changes is a public, documented method a subclass overrides -- DP's ``average``,
  ``build_buckets``, ``all_reduce``; ZeRO's ``unit_class`` with ``FlatParamUnit.average`` / ``bounds`` (FSDP2's
  per-parameter unit: ``divide_factors``, ``chunk_rows``); the pipeline executor's ``scale_loss`` -- so tests
  and the grader inject bugs through them, never by monkeypatching private names.
* Device-true: every tensor a wrapper allocates is on the module's device and every collective payload has a
  dtype NCCL accepts (no float64), so the same code runs on GPUs (``tests/test_device.py`` watches for both).
* Training helpers ``train_xx(rank, world_size, cfg, tc, <form's options>, *, mesh=None, group=None,
  model_fn=None, freeze=(), wrapper_class=<the wrapper>)`` are ``launch`` targets running
  ``loop.train_loop`` -- the only training loop besides the single-process baseline; what a chapter adds to a
  step goes through its hooks (``before_optimizer``: clipping; ``after_optimizer``: a memory sample;
  ``on_step_end``: a checkpoint, routing statistics); their results are ``TrainResult`` subclasses with
  ``losses`` (the global-batch mean per step), ``params`` (full parameters by name:
  ``course_lib.train.assert_parity(train_baseline(cfg, tc), result)``) and ``step_comm`` (per step, the
  ``comm.CommRecord`` s this rank issued). The composed run takes one ``config.ParallelConfig`` instead of a
  keyword per degree and option.
"""
