from kvmesh.testing.node.agent import main

main()
