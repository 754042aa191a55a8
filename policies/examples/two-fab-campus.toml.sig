{
  "format": "sluicegate-policy-signatures/1",
  "version": 1,
  "digest": "sha256:9772a6960f366348d15f01c66d49605541abc6d5de8fd732d1a8165160745c4c",
  "signatures": [
    {
      "key_id": "officer-alice",
      "key": "ed25519:AywAB7OMfOpArWZtt5SbbElYZUHlE4eknDFZ2Fsdnw8",
      "sig": "LJ9yCnF9pzMPZ9bkmsUQNCztDPWElucQO0GpGUaYQfGlZAAIVUzolFpfwcU-xShV9GAK8peWaQZy5jCgPMGvBw"
    },
    {
      "key_id": "officer-bob",
      "key": "ed25519:Mk9R80APMi_aBFwfU0Aj2vNfvIwKC_nPZiRrMbPoBmY",
      "sig": "AYZ5yi3gUCrIsevFuKwQthl-PJQ_I5ZhS2ufI5omfQ9RRWgbXA-LeEimlSv3Axlvaah6Ap6rSMtq0XAwd3aLAw"
    }
  ]
}
