"""The objects of a sharded checkpoint (the replicated state, each rank's own state), one
module per role: :mod:`~fastpersist.objects.write`, :mod:`~fastpersist.objects.read`,
:mod:`~fastpersist.objects.verify`, and what reading and verifying share,
:mod:`~fastpersist.objects.files`. Sharded tensors (DTensor chunks) are written by the same
writer and read by :mod:`fastpersist.loading.reshard`.
"""
