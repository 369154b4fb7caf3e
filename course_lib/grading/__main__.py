"""``python -m course_lib.grading``: see ``course_lib.grading.grader``."""

import sys

from course_lib.grading.grader import main

sys.exit(main())
