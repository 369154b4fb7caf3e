"""The rank runtime: start ranks from a cell or ``torchrun`` (``launch``, its worker and forkserver),
the mesh of process groups (``mesh``), and the collectives built from point-to-point messages
(``collectives``). Chapters START_HERE, 01 and 08.
"""
