"""Measuring a run: the memory tracker (``memtrack``), recording and the emulated device
(``instrument``), bytes across node boundaries (``topology``) and the honest run record (``report``).
"""
