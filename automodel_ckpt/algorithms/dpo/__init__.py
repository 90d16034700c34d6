"""Preference tuning (DPO, IPO, hinge, SimPO): its section (``config``), losses and algorithm (``algorithm``)."""
