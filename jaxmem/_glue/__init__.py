"""Shared Flax glue: the active options (:mod:`.options`), the one patch / interception
mechanism (:mod:`.patch`) and the conversion report (:mod:`.report`)."""
