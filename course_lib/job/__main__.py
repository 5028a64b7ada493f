"""``python -m course_lib.job CONFIG``: the report on a torchtitan, Megatron-LM or DeepSpeed configuration
(course_lib.job_report, whose docstring shows the command lines)."""

import sys

from ..job_report import main

sys.exit(main())
