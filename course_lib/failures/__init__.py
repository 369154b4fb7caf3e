"""When ranks fail or lag: restart from a checkpoint (``restart``), stragglers (``stragglers``), what a
checkpoint costs and how often to take one (``checkpoint_cost``, ``checkpoint_interval``). Chapter 10.
"""
