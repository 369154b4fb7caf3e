"""When a distributed run goes wrong (chapter 11): instruments that say which rank, which step, which collective.

* ``recorder``: each rank's collectives in a ring buffer (PyTorch's Flight Recorder, on the course's comm layer);
* ``desync``: the ranks' records compared, the first collective they disagree on and who called it wrong;
* ``hang``: for a hung run, what each rank is blocked in and which rank everyone waits for;
* ``checksums``: exact fingerprints of the tensors that must be equal (replicas) or differ (data shards);
* ``drift``: a run's distance from one process, against the noise of another reduction order;
* ``nonfinite``: the step, rank, module and tensor where a NaN or an Inf first appears;
* ``watch``: any launch target run with the instruments attached, and what they found;
* ``clinic``: broken runs, each a bug class of production trackers, and how to fix them.
"""
