"""The teaching machinery: questions, checks, grading and the exercise-notebook builder.

- :mod:`~parlib.course.results`: verdicts (:class:`CheckResult`) and the score table.
- :mod:`~parlib.course.question_types`: a number, a letter, a formula, a function.
- :mod:`~parlib.course.registry`: every chapter's questions, loaded on first use.
- :mod:`~parlib.course.answers`: answers as plain data; a function as its source.
- :mod:`~parlib.course.on_ranks`: what a rank's failure says about a learner's function.
- :mod:`~parlib.course.check`: ``parlib.check`` and ``parlib.explain``.
- :mod:`~parlib.course.grading`: ``python -m parlib grade``.
- :mod:`~parlib.course.nbbuild`: ``python -m parlib build`` (exercises/ and solutions/).
- :mod:`~parlib.course.questions`: one module of questions per chapter.

Nothing in parlib imports this package except the front door (``parlib.check``,
``parlib.explain``) and the command line.
"""
