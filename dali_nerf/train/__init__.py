"""The training runtime: one phase-timed loop (``loop``) that the DDP and SS trainers share, with its
parts — the distributed runtime (``runtime``), tasks and methods (``tasks``), checkpoints and resume
(``checkpoint``, ``resume``), evaluation, the metrics log (``runlog``, ``tblog``), the step's phase
timer (``phases``), and the emulated-device mode of the study (``emulation``, ``emulated``)."""
