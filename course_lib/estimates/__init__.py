"""What the formulas predict, on paper: memory budgets per GPU (``memory``, ``model_states``,
``activation_memory``, their units in ``memory_budget``), how a job is laid out over GPUs (``layout``),
communication, bubbles, FLOPs and MFU (``cost``), and the hardware catalogue (``hardware``).
Chapters 00, 01, 03 and 08.
"""
