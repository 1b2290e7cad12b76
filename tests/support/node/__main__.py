from kvmesh_testing.node.agent import main

main()
