"""Counting CTAs in: the last of a group to finish runs an epilogue over what all of them wrote (one launch)."""

from flashkern.kernels._tilelang import T, Flavour


def count_in_macro(fl: Flavour):
    """count_in(tickets, index, ticket): ticket[0] <- how many CTAs of group `index` counted in before this one. A
    CTA barrier (every thread's writes done), then one acq_rel atomic on tickets[index], so the CTA that draws the
    group's size - 1 sees every write of the group. tickets: int32 counters, zero before the launch; ticket: a
    shared int32 [1]."""

    @T.macro
    def count_in(tickets, index, ticket):
        if fl.on_gpu:
            T.sync_threads()
            if T.get_thread_binding() == 0:
                ticket[0] = T.atomic_add(tickets[index], 1, memory_order="acq_rel", return_prev=True)
            T.sync_threads()
        else:
            ticket[0] = T.atomic_add(tickets[index], 1, return_prev=True)

    return count_in
