from benchmarks.gpu import main

main()
