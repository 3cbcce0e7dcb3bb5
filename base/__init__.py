"""The base every nextstate process shares, at the bottom of the layers: the one settings object
(``settings``), the domain's words (``vocab``), the error tree (``errors``) and the redaction
detectors (``redact``). It imports nothing of nextstate's."""
