"""The task types ``lm_text``, ``qa_jsonl``, ``classification`` and ``chat``: constructed (files and columns
checked) before any model is loaded, then ``build`` tokenizes them into examples with ``input_ids`` and ``labels``
(``-100`` on prompt tokens); QA examples add ``prompt_ids`` and ``answer``, classification ones ``prompt_ids`` and
``label``."""

from lcsb_lightning.recipes.tasks.base import Task, TaskData, extract_number
from lcsb_lightning.recipes.tasks.chat import ChatTask
from lcsb_lightning.recipes.tasks.classification import ClassificationTask
from lcsb_lightning.recipes.tasks.lm_text import LMTextTask
from lcsb_lightning.recipes.tasks.qa import QAJsonlTask

__all__ = ["Task", "TaskData", "extract_number", "ChatTask", "ClassificationTask", "LMTextTask", "QAJsonlTask"]
