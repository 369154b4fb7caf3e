"""The planner: every valid mesh for a model on a cluster, pruned by memory, ranked by predicted step
time (``search``, ``candidate``, ``memory``, ``model``, ``comm``, ``moe``); published runs to check it
against (``published``); composed runs next to its predictions (``memcheck``, ``mesh_runs``). Chapter 08.
"""
