from devgraph.backends.cpu import CpuDevice  # the reference device, on the cpu backend's face


class ToyDevice(CpuDevice):
    name = "toy"
