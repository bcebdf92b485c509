"""`asteroid deploy`: the cluster's containers on devices reached over ssh.

`inventory` reads the devices file, `machine` picks each device's image
architecture from what the device says it is, `desired` says what each device
should hold, `observe` parses what a device reports, `reconcile` turns the two
into actions (pure), and `ssh` and `apply` run those actions on the devices.
"""
