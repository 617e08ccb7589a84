"""The MARFT paper's dual LaMAS (reasoner -> actor) on generated arithmetic word problems."""
