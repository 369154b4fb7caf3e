"""The course's own tooling: each learner's working copy (``my_copy``), the static site (``site``) and
the learners' handout (``handout``).
"""
