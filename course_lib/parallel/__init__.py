"""Every kind of parallelism, from scratch on real ``torch.distributed`` ranks: one axis, one file.

* Axes, each an in-place change of the model that records where every parameter lives
  (``placement``): ``tp`` (+ ``tp_layers``, ``tp_comm``), ``cp`` (+ ``cp_attention``), ``ep``,
  ``pp`` (+ ``pp_stages``, ``pp_executor``, ``pp_split``, the schedules as data in ``schedules``).
* Data parallelism, the only part that reduces gradients, by the rule of ``dp_reduce``: ``dp``
  (``DataParallel``), ``sharded_optimizer`` (ZeRO-1), ``zero`` + ``zero_unit`` (ZeRO-2/3, flat),
  ``fsdp2`` (per parameter, HSDP) and their shared schedule ``sharding``; ``fsdp2_pipeline`` under a
  pipeline.
* Composition: ``compose.parallelize`` runs the steps TP -> CP -> EP -> PP -> DP on one mesh, with
  the options of one ``config.ParallelConfig``; ``contract`` is the loop's interface, ``loop`` the
  one training loop, ``runs`` the launch targets, ``oracles`` PyTorch's own versions, ``checkpoint``
  the formats, ``placement_ops`` what reads placements across a model.
* Variants the composition wires in: ``tp_overlap`` (collective matmul), ``cp_ulysses`` (all-to-all
  attention), ``pp_balance`` (stages from measured costs), ``moe_mesh`` (routing on any mesh).
"""
