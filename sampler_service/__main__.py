from sampler_service.cli import main

main()
