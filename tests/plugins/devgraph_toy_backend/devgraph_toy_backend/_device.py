from devgraph.backends.cpu._device import CpuDevice


class ToyDevice(CpuDevice):
    name = "toy"
